"""Layer 6: `patchkit probe report`: reads the nan-probe's log."""
