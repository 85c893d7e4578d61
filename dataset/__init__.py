"""The parts of my_dataset.py: the data folder and its split, images read, decoded once or held on the device,
transform presets, seeded sampling, the demo data and the start-up check of every image."""
