"""User-extension examples: each file adds a method by subclassing a pl_fedsparse callback.

This folder is what a project of your own looks like: run ``pl-fed`` from the repository root and refer to a file
here by ``class_path: callbacks.<file>.<Class>``. The same files are installed with the package as
``pl_fedsparse.examples`` (``setup.py`` maps this folder), so the shipped configs name them
``pl_fedsparse.examples.<file>.<Class>`` and run from any directory, also after a regular ``pip install``.
"""
