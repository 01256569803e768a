"""Multi-turn agent workloads: the production measurement as kvgate traces.

`plan` draws seeded sessions, `deployment` sizes the pool, `generator` plays
the scheduler over the model to write one fixed trace per unit x hold arm,
`measure` replays a trace on a target and counts its follow-ups' misses,
`runner` ties them together for `kvgate workload` (`command`).
"""
