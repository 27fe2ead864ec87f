"""Applications on top of the library: the `fp8comm` command (fp8comm.tools.cli), the demo, the benchmarks and
the small GPT they train. Layering: tools may import fp8comm's core and fp8comm.integrations; nothing in
fp8comm.quant, gemm, comm or integrations imports tools, and `import fp8comm` does not import this package.

rich and matplotlib come with the 'tools' extra (pip install 'fp8comm[tools]'); the modules here import them only
inside the functions that print or plot, and the command says which extra is missing instead of a traceback.
"""
