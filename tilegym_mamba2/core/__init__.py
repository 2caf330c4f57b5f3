"""What every other part of the package builds on: the registry, argument checks, packed-sequence
and group helpers, and the toolchain diagnosis. Nothing here imports the rest of the package."""
