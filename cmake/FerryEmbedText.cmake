# Embeds a text file (e.g. tuning data) into a C++ source as a function returning a
# std::string_view: `std::string_view <namespace>::<function>()`.
function(ferry_embed_text output namespace function input)
  add_custom_command(
    OUTPUT ${output}
    COMMAND ${CMAKE_COMMAND} -DOUTPUT=${output} -DNAMESPACE=${namespace} -DFUNCTION=${function} -DINPUT=${input}
            -P ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/FerryEmbedTextRun.cmake
    DEPENDS ${input} ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/FerryEmbedTextRun.cmake
    COMMENT "Embedding ${input}")
endfunction()
