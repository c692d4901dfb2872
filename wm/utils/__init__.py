"""What every layer uses: one-line errors, atomic files, folder locks, stop signals, torchrun plumbing, precision, logs."""
