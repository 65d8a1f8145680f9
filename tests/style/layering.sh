#!/usr/bin/env bash
# The layering of docs/DESIGN.md, checked: each layer's sources and public headers include only
# its own layer and the layers below it (cl < ops < offload < graph < runtime), by public path
# ("ferry/<layer>/...") or private one ("<layer>/..."). Fails naming every upward include.
# usage: layering.sh <source root>
set -uo pipefail
cd "${1:?usage: layering.sh <source root>}" || exit 2
layers=(cl ops offload graph runtime)
rank() {
  local i
  for i in "${!layers[@]}"; do [[ ${layers[$i]} == "$1" ]] && echo "$i" && return; done
  echo -1
}
bad=0
checked=0
for layer in "${layers[@]}"; do
  own=$(rank "$layer")
  while IFS= read -r file; do
    checked=$((checked + 1))
    while IFS=: read -r line target; do
      used=$(rank "$target")
      if ((used > own)); then
        echo "upward include: $file:$line ($layer) includes a header of $target"
        bad=$((bad + 1))
      fi
    done < <(grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]*"(ferry/)?(cl|ops|offload|graph|runtime)/' "$file" |
      sed -E 's/^([0-9]+):.*include[[:space:]]*"(ferry\/)?([a-z]+)\/.*/\1:\3/')
  done < <(find "$layer" "include/ferry/$layer" -type f \( -name '*.cpp' -o -name '*.hpp' -o -name '*.h' \) 2>/dev/null | sort)
done
echo "$checked files of ${#layers[@]} layers checked, $bad upward includes"
((checked > 0 && bad == 0))
