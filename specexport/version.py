"""The package version: a leaf module, so that the manifest and the build can read it without importing the
package (whose __init__ imports the runtime)."""

__version__ = "0.1.0"
