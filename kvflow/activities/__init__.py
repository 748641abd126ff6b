"""Everything that touches the outside world: inference over vLLM, placement, ledger writes."""
