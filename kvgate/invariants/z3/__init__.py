"""The manager as a Z3 transition system: its invariants proved inductive,
and counterexamples written as version-1 traces (see ARCHITECTURE.md)."""
