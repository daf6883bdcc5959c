#!/bin/bash
# usage: sass.sh <prefix>: extracts the main bwd kernel SASS and prints counts
export PATH=/tmp/cuobj/x/nvidia/cu13/bin:$PATH
p=$1
cuobjdump -sass $p.cubin > $p.all.sass
awk '/Function : .*flash_bwd_kernel_sm90/{f=1} /Function : /{if($0 !~ /flash_bwd_kernel_sm90/) f=0} f' $p.all.sass > $p.sass
echo "max reg: $(grep -oE '\bR[0-9]+\b' $p.sass | sed 's/R//' | sort -n | tail -1)"
grep -oE "(HGMMA\.[0-9x]+|WARPGROUP\.[A-Z]+|BAR\.SYNC[.A-Z_]*|BAR\.ARV|SYNCS\.[A-Z.0-9]+|ATOMG[.A-Z0-9x]*|REDG[.A-Z0-9x]*|STSM[.A-Z0-9]*|LDSM[.A-Z0-9]*|STS[.0-9A-Z]*|LDS[.0-9A-Z]*|USETMAXREG[.A-Z_]*|MEMBAR[.A-Z]*|FENCE[.A-Z]*|LDL|STL)\b" $p.sass | sort | uniq -c | sort -rn
