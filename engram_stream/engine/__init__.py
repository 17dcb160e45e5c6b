"""What every variant's streaming engine shares: argument checks (args.py), the kernel path
(isa.py), the per-token driver of every layer (decoder.py)."""
