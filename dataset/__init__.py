"""The parts of my_dataset.py: the data folder read and split, an image file read, the transform presets, the
images decoded once into memory, seeded sampling, the demo data and the start-up check of every image."""
