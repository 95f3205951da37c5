"""The engine, in layers whose imports point one way (docs/architecture.md, enforced by
tests/test_layering.py): models/ → core/ → executor/ → worker/ → sched/ → the leaves
(request.py, spec.py, outputs.py, errors.py). It never imports the web framework or torch.
"""
