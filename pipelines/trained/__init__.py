"""Trained embedded models: a captioned synthetic shapes dataset, its caption grammar, and
the training code of small models that draw what their captions ask for.

`captions` and `dataset` are torch-free (the quality scorer, `quality`, reads them); the
training modules import torch.
"""
