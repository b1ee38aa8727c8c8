"""The ``images`` pipeline: decode any folder of pictures and resize / center-crop them."""
