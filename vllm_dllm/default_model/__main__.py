from vllm_dllm.default_model import PATH

print(PATH)
