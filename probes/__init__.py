"""What runs inside the training process: memory at step boundaries, collectives per step."""
