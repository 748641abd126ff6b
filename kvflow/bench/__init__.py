"""kvflow's benchmarks, one module each, above the layers they measure.

- `kvflow.bench.policies`: cost per successful task, goodput, SLO and model time of kvflow's
  scheduler against the anchor routers (llm-d, Dynamo, SGLang, AIBrix) on the simulated fleet,
  every policy with the same mechanisms and information (`kvflow bench policies`);
- `kvflow.bench.decision_latency`: how long `Scheduler.place` takes on fleets of 16 to 1,024
  replicas (`kvflow bench scheduler`);
- `kvflow.bench.simulator_speed`: simulated requests per wall-clock minute of the
  discrete-event core (`kvflow sim bench`);
- `kvflow.bench.overhead`: a kvflow step against the same call as a plain Temporal activity,
  through a real Temporal dev server (`kvflow bench overhead`).

Each prints figures and writes JSON; none is asserted by a timed test. `benchmarks/README.md`
gives the method and the latest figures.
"""
