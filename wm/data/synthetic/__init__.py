"""The built-in data set: procedural scenes in three styles, written as shards and cached."""
