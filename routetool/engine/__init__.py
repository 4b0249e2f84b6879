"""The engine every trace command runs on: the kernel-under-test contract (:mod:`.contract`), the
streaming pipeline over a trace's steps (:mod:`.stream`) and the verdict a result carries
(:mod:`.verdict`)."""
