from vllm_dllm.llada2_model import PATH

print(PATH)
