"""Step-level batching: a request's denoising state and the shared step (`state`), the
stages that drive a family's hooks (`stages`), setting a request up (`setup`), and
previews (`preview`)."""
