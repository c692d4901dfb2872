"""Converting recorded data sets (Occ3D-nuScenes, own recordings) into shards."""
