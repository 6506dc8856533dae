"""Training: the specification (losses, optimizers, schedules), the training step as one
graph (forward, loss, backward through flowc.autodiff, optimizer update), and the loop that
runs a compiled step over a dataset."""
