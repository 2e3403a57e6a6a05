"""Training the draft head by self-distillation from the target (``make train-draft``)."""
