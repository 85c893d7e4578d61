"""my_dataset.py's parts: the split, images read, decoded or held on the device, transforms, sampling, demo data."""
