"""Code generation: a rank graph, its schedule and its memory plan -> a standalone C++
project. ``program.py`` writes the text (``generate``, ``generate_pipeline``), ``project.py``
writes OUT/, ``cpp.py`` holds the C++ text helpers; flowc.compiler drives them.

Nothing is imported here: the op modules use ``cpp.py`` while they register, and importing
``program.py`` from this package's import would pull the schedule (and through it the cost
model and the op registry) into that registration half-done."""
