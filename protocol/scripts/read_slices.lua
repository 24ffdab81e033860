
local out = {}
for k = 1, #KEYS do
  local h = redis.call('HMGET', KEYS[k], 'cap', 'rem')
  if h[1] then
    out[#out + 1] = tonumber(h[1])
    out[#out + 1] = tonumber(h[2])
  else
    out[#out + 1] = -1
    out[#out + 1] = 0
  end
end
return out
