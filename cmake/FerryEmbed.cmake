# Embeds OpenCL kernel files into a C++ source as raw string literals, keyed by file stem (headers,
# .clh, by file name), so kernels stay real, lintable .cl files while the library ships as one binary.
function(ferry_embed_kernels output)
  set(inputs ${ARGN})
  # A ';' list would be split into separate shell words; pass the files '|'-separated instead.
  string(REPLACE ";" "|" joined "${inputs}")
  add_custom_command(
    OUTPUT ${output}
    COMMAND ${CMAKE_COMMAND} -DOUTPUT=${output} "-DINPUTS=${joined}" -P ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/FerryEmbedRun.cmake
    DEPENDS ${inputs} ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/FerryEmbedRun.cmake
    COMMENT "Embedding OpenCL kernel files"
    VERBATIM)
endfunction()
