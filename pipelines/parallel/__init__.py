"""One request across several devices: a lane's workers as one `torch.distributed` group."""
