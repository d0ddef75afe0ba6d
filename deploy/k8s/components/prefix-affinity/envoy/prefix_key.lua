-- The prefix key of an HTTP request that came without one (the cohere and openai SDKs,
-- LangChain, curl): the same function as prefixscore's own (prefix_key.py), CRC-32 of
-- "<kind>\n<instruction>\n<query>" as 8 lowercase hex digits, computed from the `query`,
-- `instruction` and `prompt_name` the json_to_metadata filter before this one read from the
-- JSON body. A query of token ids (a list) is not read there: such a request is routed without
-- a key. An embedding request's key is its prompt's name (none: the model's default prompt).

local HEADER = "x-prefixscore-prefix-key"
local NAMESPACE = "prefixscore"

local CRC = {}
for i = 0, 255 do
  local c = i
  for _ = 1, 8 do
    if bit.band(c, 1) == 1 then
      c = bit.bxor(bit.rshift(c, 1), 0xEDB88320)
    else
      c = bit.rshift(c, 1)
    end
  end
  CRC[i] = c
end

local function crc32(text)
  local crc = bit.bnot(0)
  for i = 1, #text do
    crc = bit.bxor(bit.rshift(crc, 8), CRC[bit.band(bit.bxor(crc, text:byte(i)), 0xFF)])
  end
  return bit.tohex(bit.bnot(crc))
end

local function kind_of(path)
  if path:find("^/v1/score") then
    return "score"
  end
  if path:find("^/v1/rerank") or path:find("^/v2/rerank") or path:find("^/rerank") then
    return "rerank"
  end
  if path:find("^/v1/embeddings") or path:find("^/embed") then
    return "embed"
  end
  return nil
end

function envoy_on_request(handle)
  local headers = handle:headers()
  if headers:get(HEADER) ~= nil then
    return
  end
  local kind = kind_of(headers:get(":path") or "")
  if kind == nil then
    return
  end
  local fields = handle:streamInfo():dynamicMetadata():get(NAMESPACE) or {}
  if kind == "embed" then
    local name = ""
    if type(fields.prompt_name) == "string" then
      name = fields.prompt_name
    end
    headers:add(HEADER, crc32(kind .. "\n" .. name .. "\n"))
    return
  end
  if type(fields.query) ~= "string" then
    return
  end
  local instruction = ""
  if kind == "rerank" and type(fields.instruction) == "string" then
    instruction = fields.instruction
  end
  headers:add(HEADER, crc32(kind .. "\n" .. instruction .. "\n" .. fields.query))
end
