"""Layer 1: paths walked by directory descriptors (safepath), settings and cache files
(files), signals held across writes (signals), waiting for a lock (locks), patchkit's own
cache folder (places).
"""
