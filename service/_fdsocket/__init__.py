"""The fd socket: reference decodes out, ranks' frames in, as descriptors."""
