"""The training example's pieces (examples/train.py): the text and its batches, the
decoder with and without Engram, the host tables and the jitted training steps."""
