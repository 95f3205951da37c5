"""Step-level batching's parts: a request's denoising state and the shared step (`state`),
setting a request up (`setup`), two experts (`experts`) and previews (`preview`). The stages
that drive them with a family's hooks are above, in `pipelines.step_level`, which nothing
here imports."""
