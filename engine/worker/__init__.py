"""What runs a pipeline, wherever it lives (an executor thread or a worker process): one
batch with per-request fate, step-level stages, decodes beside the steps, timing on the
device, the profile run at start. Imports the scheduling policy and the leaves."""
