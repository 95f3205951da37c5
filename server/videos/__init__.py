"""Video jobs (`/v1/videos`): their wire schemas (protocol.py), a create's body parsed
(create.py, with a controlled video's inputs: control_inputs.py), what a remix repeats
(remix.py), the jobs in motion (service.py: admit, follow, store; progress.py: their state
as the engine runs them; output.py: their files), their start-up (start.py), and MP4
encoding (encoding.py). Where jobs are kept: `server/jobs/`."""
