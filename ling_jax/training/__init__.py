"""Training: the loss (with the MTP draft loss) and the optimiser step (`train`)."""
