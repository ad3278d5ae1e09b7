"""Image inputs for vision-language models, below the engine and the server: decoding client image references
(image_inputs.py) and the checkpoint's image preprocessing with placeholder expansion (image_processing.py). Errors
are ImageInputError (a ValueError): the server answers them with a 400, the offline engine raises them."""
