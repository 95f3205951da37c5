"""Tasks: what a kind of request adds to any family that supports it (`base.Task`), one
module-level instance each."""
