"""The boundary layer: every byte that enters rayless from a peer or a file is decoded here, bounded.

Owns `BoundaryError` (one refusal that names the peer or file and why), the bounded JSON decoder
(`json_input`) and the alias-free YAML loader (`yaml_input`). Invariant: nothing decoded through this
package can recurse without bound, grow past its limits, or raise anything but `BoundaryError`.
"""
