
local function paced_allowance(h, rem, cap, now, start, len)
  if h[1] ~= '1' then return rem, 0 end
  local burst = tonumber(h[2]) or 0
  local function paced(t)
    local r = math.floor(cap * (t - start) / len)
    if r > cap then return cap end
    if r < 0 then return 0 end
    return r
  end
  local granted = cap - rem
  local forfeit = math.max(0, math.min(rem, paced(now) - granted))
  local released = math.min(cap, paced(now + math.min(math.floor(len / 40), 1000)) + burst)
  return math.min(rem - forfeit, released - granted - forfeit), forfeit
end
