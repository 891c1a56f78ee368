"""The token relay's loop in C (narwhal/_crelay.c), built where a C compiler is found.

Everything else is in setup.cfg. The extension is optional: without a compiler the
install goes on and the relay runs its pure-Python loop (docs/benchmarks.md, "The token
relay", says what each costs).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("narwhal._crelay", ["narwhal/_crelay.c"], optional=True, extra_compile_args=["-O2"])])
