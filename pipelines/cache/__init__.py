"""Cache acceleration (issue 27): skipping denoiser blocks at steps where a cheap probe says
their output would barely change. `first_block`: First-Block Cache decided per request inside
a shared step (step mode); `whole_batch`: diffusers' own hooks over a request-level forward.
"""
