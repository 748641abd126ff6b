"""`fleet.toml`: the one configuration file of a kvflow deployment.

It holds the Temporal connection and the fleet (models, GPU pools, tenants). `load_fleet`
reads and validates it and reports every problem at once, each with the file, the key path and
what is wrong, so an operator fixes the file in one pass.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from temporalio.envconfig import ClientConfigProfile, ClientConfigTLS, ClientConnectConfig

from kvflow.scheduler.fleet import Fleet


class TemporalTls(BaseModel):
    """TLS settings, named as in the Temporal SDK's environment configuration."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    disabled: bool = False
    server_name: str | None = None
    server_ca_cert_path: Path | None = None
    client_cert_path: Path | None = None
    client_key_path: Path | None = None


class TemporalConnection(BaseModel):
    """Where the Temporal service is and how to authenticate.

    As in the Temporal SDK's environment configuration, `TEMPORAL_ADDRESS`,
    `TEMPORAL_NAMESPACE` and `TEMPORAL_API_KEY` override the file. The API key itself never
    lives in the file: `api_key_env` names the variable that holds it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    address: str = Field(default="127.0.0.1:7233", pattern=r"^[^\s:/]+:\d{1,5}$")
    namespace: str = Field(default="default", min_length=1)
    api_key_env: str = Field(default="TEMPORAL_API_KEY", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    tls: TemporalTls | None = None

    def effective_address(self) -> str:
        """The address a client will dial: `TEMPORAL_ADDRESS` if set, else the file's."""
        return os.environ.get("TEMPORAL_ADDRESS") or self.address

    def connect_config(self) -> ClientConnectConfig:
        """Keyword arguments for `temporalio.client.Client.connect`."""
        tls = None
        if self.tls is not None:
            tls = ClientConfigTLS(
                disabled=self.tls.disabled,
                server_name=self.tls.server_name,
                server_root_ca_cert=self.tls.server_ca_cert_path,
                client_cert=self.tls.client_cert_path,
                client_private_key=self.tls.client_key_path,
            )
        profile = ClientConfigProfile(
            address=self.effective_address(),
            namespace=os.environ.get("TEMPORAL_NAMESPACE") or self.namespace,
            api_key=os.environ.get(self.api_key_env) or None,
            tls=tls,
        )
        return profile.to_client_connect_config()


class FleetConfig(Fleet):
    """The whole of `fleet.toml`: the Temporal connection and the fleet."""

    temporal: TemporalConnection = TemporalConnection()


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with a configuration file."""

    file: Path
    key_path: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}: {self.key_path}" if self.key_path else str(self.file)
        return f"{where}: {self.message}"


class FleetConfigError(Exception):
    """`fleet.toml` is missing, unreadable or invalid; `problems` lists every issue found."""

    def __init__(self, problems: list[ConfigProblem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


def _key_path(loc: tuple[int | str, ...]) -> str:
    # ("pools", 1, "token_prices", "output_per_mtok_usd") -> pools[1].token_prices.output_...
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif "[" in part:
            # pydantic names the union branch it tried (`list[...]`, `literal['simulated']`);
            # the user only wrote the key.
            continue
        else:
            # A key with a character a terminal would not show (a form feed, a private-use
            # code point) is named in Python's escapes, so that the message shows what is
            # wrong with it instead of a key that looks right.
            name = part if part.isprintable() else repr(part)
            path += f".{name}" if path else name
    return path


def _message(error: dict[str, object]) -> str:
    message = str(error["msg"])
    if error["type"] == "missing":
        return "missing: this key is required"
    if error["type"] == "extra_forbidden":
        return "unknown key (check its spelling against fleet.toml's documented keys)"
    return message.removeprefix("Value error, ")


EXAMPLE_FLEET = Path(__file__).resolve().parent.parent / "fleet.toml"
"""The commented example fleet that ships with kvflow (3 simulated pools, 3 tenants)."""


def load_fleet(path: Path | str) -> FleetConfig:
    """Read and validate a fleet file; raise `FleetConfigError` listing every problem."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FleetConfigError([ConfigProblem(path, "", "no such file")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise FleetConfigError([ConfigProblem(path, "", f"cannot read it: {exc}")]) from None
    except tomllib.TOMLDecodeError as exc:
        raise FleetConfigError([ConfigProblem(path, "", f"not valid TOML: {exc}")]) from None
    try:
        return FleetConfig.model_validate(raw)
    except ValidationError as exc:
        errors = exc.errors()
        problems = [
            ConfigProblem(path, _key_path(tuple(e["loc"])), _message(dict(e))) for e in errors
        ]
        # When a value fits no branch of `"simulated" | list[URL]`, the branch the user meant is
        # the one that got further: drop "should be 'simulated'" beside a deeper error.
        deeper = {p.key_path for p in problems}
        problems = [
            p
            for p, e in zip(problems, errors, strict=True)
            if not (
                e["type"] == "literal_error"
                and any(k.startswith((p.key_path + "[", p.key_path + ".")) for k in deeper)
            )
        ]
        raise FleetConfigError(list(dict.fromkeys(problems))) from None
