"""Parameters, gradients and optimizer states held in chunks; stage policies over them."""
