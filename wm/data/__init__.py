"""Occupancy data: the shard format and writer, windows and the sampler, statistics, horizons, pictures; converters and the built-in scenes."""
