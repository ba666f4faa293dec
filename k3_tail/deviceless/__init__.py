"""Deviceless GPU topologies: meshes of H100s, H200s, MI300Xs or MI355Xs that are not present, for compiling
the real GPU schedule on any machine (:mod:`~k3_tail.deviceless.topologies`, whose ``topology_mesh`` is
``k3_tail.topology_mesh``), from the target records in ``targets/``; and the stand-in ROCm runtime libraries
that let jax's ROCm plugin compile without ROCm (:mod:`~k3_tail.deviceless.rocm_stand_ins`, internal)."""
