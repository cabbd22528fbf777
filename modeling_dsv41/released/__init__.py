"""DeepSeek's released checkpoint format: its number formats (:mod:`~modeling_dsv41.codec`), what a checkpoint holds
(:mod:`.reading`), its names and layout mapped onto ours (:mod:`.conversions`), the steps ``from_pretrained`` takes
for it (:mod:`.loading`), writing it (:mod:`.writing`), its native precision kept in memory (:mod:`.native_precision`,
with LoRA on it: :mod:`.native_lora`) and the offline conversion into our plain format (:mod:`.convert`)."""
