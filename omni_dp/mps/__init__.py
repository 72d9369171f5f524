"""CUDA MPS: control client, private daemon, attachment proof, preflight (no other omni_dp
package is imported here)."""
