"""Layer 1: paths walked by directory descriptors (safepath), settings and cache files
(files), waiting for a lock (locks), patchkit's own cache folder (places).
"""
