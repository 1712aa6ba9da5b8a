"""The machinery behind issue395_second_stack_vram.py: everything that is not the protocol.

One concern a module, each importing only what lies below it (docs/LAYOUT.md).
The package never imports the entry script: the script hands its measured arm in.
"""
