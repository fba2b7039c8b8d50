"""User-extension examples: each file adds a method by subclassing a pl_fedsparse callback.

Run ``pl-fed`` from the repository root and refer to them by ``class_path: callbacks.<file>.<Class>``.
"""
