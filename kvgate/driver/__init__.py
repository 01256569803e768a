"""Trace ops as the manager calls vLLM's Scheduler makes, written once for
every target: the model and the vLLM adapter subclass the driver."""
