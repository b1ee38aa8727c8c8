"""The ``volumes`` pipeline: 3D medical images reoriented, resampled, normalised and cropped once."""
